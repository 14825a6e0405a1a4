"""The sglang-compatible reference server and what it loads.

`checkpoint` turns the embedded GGUF into a real safetensors checkpoint, `engine` runs the model
(continuous interleaved decoding in one worker thread), `sampling` holds the pure request rules,
`app` speaks sglang's native HTTP API, and `server` runs it on hypercorn under trio.
"""

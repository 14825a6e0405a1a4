"""Arms the GEMM audit's capture in an sglang server: `command.sglang_launch` puts this folder on
the server's PYTHONPATH, so every Python process it starts runs this at startup. Where
ENGY_GEMM_CAPTURE_PORT is set it loads ../gemm_capture.py by path (not through the
engy_node.miner packages, whose imports need the node's own environment) and calls its
`install`; anything that goes wrong is printed and startup goes on, without commitments."""

import importlib.util
import os
import sys


def _arm() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    capture_file = os.path.join(os.path.dirname(here), "gemm_capture.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))
    if root not in sys.path:
        sys.path.append(root)  # gemm_capture imports engy_node.gemm and engy_node.serve.capture
    spec = importlib.util.spec_from_file_location("engy_gemm_capture", capture_file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {capture_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.install()


if os.environ.get("ENGY_GEMM_CAPTURE_PORT"):
    try:
        _arm()
    except Exception as error:  # never break interpreter startup
        print(f"[engy] GEMM capture not armed: {error!r}", file=sys.stderr)

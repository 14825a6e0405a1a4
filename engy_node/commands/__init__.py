"""The `engy-node` sub-commands with flags and work enough of their own to read apart from the
dispatch in `cli.py`: each module is one sub-command (or group), as `add_parser(sub)`, which adds
its parser, and `run(config, args)`, which does it and returns the exit code.

* `calibrate`: the separation of honest serving and known cheats on this machine.
* `gateway_admin`: `engy-node gateway …`, a gateway operator's actions on its store.
* `weights`: `engy-node weights commit`, a checkpoint's weight commitment (engy_node/gemm); it
  needs no config, so its `run(args)` takes none.

The other sub-commands are a few lines each and stay in `cli.py`.
"""

"""Each command's declaration: its arguments, options and help, importing click and the
leaves only, so its `--help` and shell completion are instant (cli/lazy.py); the body it
runs is named by `runs("module:function")`."""

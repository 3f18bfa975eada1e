"""`jaxscale COMMAND [flags]` (also `python -m jaxscale COMMAND`): every entry point, one command.

The command runs exactly as `python -m jaxscale.launch.MODULE [flags]` would (absl parses the
flags), so `jaxscale train --config=tiny_lm --workdir=runs/x` works from any directory.
"""

from __future__ import annotations

import difflib
import runpy
import sys
from collections.abc import Sequence

from jaxscale.launch import COMMANDS


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    return "\n".join(["usage: jaxscale COMMAND [--flags]   (jaxscale COMMAND --help for its flags)",
                      "", "commands:", *lines])


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if len(argv) >= 2 else 2)
    name = argv[1]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" Did you mean `jaxscale {close[0]}`?" if close else ""
        print(f"jaxscale: error: unknown command {name!r}.{hint} Commands: "
              f"{', '.join(COMMANDS)}.", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"jaxscale {name}", *argv[2:]]
    runpy.run_module(f"jaxscale.launch.{COMMANDS[name][0]}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""`python -m launch.NAME` from a checkout runs `jaxscale/launch/NAME.py`.

The entry points moved into the package (installed, they are `jaxscale NAME`), so that
installing jaxscale installs no top-level `launch` package; this alias keeps the
`python -m launch.*` commands of earlier versions working from the repository root.
"""

import jaxscale.launch as _entry_points

__path__ = list(_entry_points.__path__)

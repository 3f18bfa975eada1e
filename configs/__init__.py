"""`import configs.tiny_lm` from a checkout: the bundled configs live in `jaxscale/configs/`.

They moved into the package so that installing jaxscale installs no top-level `configs`
package; this alias keeps scripts and tests that import them from the repository root working.
"""

import jaxscale.configs as _bundled

__path__ = list(_bundled.__path__)

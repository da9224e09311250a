"""``python -m overlap dump ...``: see ``overlap.dump`` (the ``overlap`` command has more)."""

import sys

from overlap.dump import main

sys.exit(main())

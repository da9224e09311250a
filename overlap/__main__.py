"""``python -m overlap dump ...``: see ``overlap.compile.dump`` (``overlap`` has more)."""

import sys

from overlap.compile.dump import main

sys.exit(main())

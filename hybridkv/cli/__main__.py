"""``python -m hybridkv.cli``: the same as the ``hybridkv`` command."""

import sys

from hybridkv.cli import main

sys.exit(main())

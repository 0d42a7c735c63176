"""``python -m dflash_trainer`` (what torchrun launches)."""

import sys

from dflash_trainer.cli import main

sys.exit(main())

"""``python -m dflash_trainer`` (what torchrun launches)."""

import sys

from dflash_trainer.cli.main import main

sys.exit(main())

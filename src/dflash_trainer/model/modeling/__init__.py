"""Standalone modeling files shipped next to exported drafters (``dflash.py``; DFlash2 exports
also ship ``dflash2.py``, which imports its sibling ``dflash.py``)."""

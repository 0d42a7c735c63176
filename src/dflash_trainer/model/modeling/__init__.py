"""Standalone modeling files shipped next to exported drafters (``dflash.py``)."""

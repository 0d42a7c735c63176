"""Standalone modeling files shipped next to exported drafters: ``dflash.py``, and a variant's
own file, which imports its sibling ``dflash.py`` (:mod:`dflash_trainer.model.variants`)."""

"""Sources of the target's features other than the in-process forward: the feature store
(:mod:`.build` writes it, :mod:`.store` reads it, :mod:`.target_parts` loads the little of the
target that training from it needs)."""

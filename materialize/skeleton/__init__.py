"""The model skeleton: built on meta (meta_init), from a spec (build) or a transformers config.json (hfbuild),
walked (named_modules)."""

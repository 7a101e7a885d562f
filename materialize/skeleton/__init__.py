"""The model skeleton: built on meta (meta_init), from a spec (build), walked (named_modules)."""

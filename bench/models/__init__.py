"""The demo and benchmark models (outside the library package: `make demo` and `make bench` build them)."""

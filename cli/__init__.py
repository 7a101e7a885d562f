"""The materialize command line: a thin layer over the library."""

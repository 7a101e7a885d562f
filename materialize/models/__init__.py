"""Models shipped with the package: the demo and benchmark transformer."""

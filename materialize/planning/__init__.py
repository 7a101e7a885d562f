"""Planning a load before any byte is read: names matched, ties grouped, devices, dtypes and memory."""

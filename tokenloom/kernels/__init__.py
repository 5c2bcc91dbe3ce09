"""Native CPU kernels (plain C compiled at first use, called through ctypes) behind Python seams that fall
back to torch when a kernel is unavailable."""

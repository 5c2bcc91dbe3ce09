"""Model architectures, configuration and weight loading."""

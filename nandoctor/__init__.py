"""nandoctor: measure which precision / attention / compile configuration trains stably."""
__version__ = "0.1.0"

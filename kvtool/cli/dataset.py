"""`kvtool dataset`: registered on the app by kvtool.cli (module owned by the dataset work)."""

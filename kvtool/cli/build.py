"""`kvtool build`: registered on the app by kvtool.cli (module owned by the build work)."""

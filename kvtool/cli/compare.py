"""`kvtool compare`: registered on the app by kvtool.cli (module owned by the compare work)."""

"""`kvtool bench`: registered on the app by kvtool.cli (module owned by the bench work)."""

"""``sglang-morph``: one operator command for the server and the offline tools.

``main.py`` holds the click commands, ``client.py`` the HTTP calls to a running server,
``view.py`` the pure rendering of status answers and ``top.py`` the live view that polls them.
"""

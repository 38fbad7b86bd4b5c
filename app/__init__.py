"""The omlx desktop shell: menu-bar (macOS) or tray (Linux) icon, admin window, and a
supervised ``omlx serve`` child. It talks to the server over HTTP only."""

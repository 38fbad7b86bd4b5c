"""The HTTP edge: app factory, routes, SSE and the error mapping."""

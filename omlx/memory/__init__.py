"""Memory safety: predict a prefill's peak, admit by budget, gate chunks, enforce the ceiling."""

// Before first paint, so a saved theme never flashes the other one. A file, not an
// inline script: the panel's Content-Security-Policy allows scripts from 'self' only.
try {
  const saved = localStorage.getItem("omlx.theme");
  if (saved === "light" || saved === "dark") document.documentElement.dataset.theme = saved;
} catch (_) {
  /* storage disabled: follow the system */
}

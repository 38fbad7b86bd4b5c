#!/usr/bin/env bash
# Vendor the admin panel's third-party libraries into web/vendor/ from the npm registry.
# Versions are pinned in web/package.json + package-lock.json; `npm ci` runs in a temp
# folder, so no node_modules is left in the repo. Re-run after changing a version.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

cp "$here/package.json" "$here/package-lock.json" "$tmp/"
(cd "$tmp" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)

out="$here/vendor"
rm -rf "$out"
mkdir -p "$out"

# copy PACKAGE FILE[:NEW_NAME]... (paths relative to node_modules/PACKAGE)
copy() {
  local pkg="$1" dest="$out/$1"
  shift
  mkdir -p "$dest"
  for spec in "$@"; do
    local src="${spec%%:*}" name="${spec##*:}"
    cp "$tmp/node_modules/$pkg/$src" "$dest/$(basename "$name")"
  done
  local version
  version="$(node -p "require('$tmp/node_modules/$pkg/package.json').version")"
  echo "$version" >"$dest/VERSION"
}

copy uplot dist/uPlot.esm.js dist/uPlot.min.css LICENSE
copy marked lib/marked.esm.js LICENSE
# .js, not .mjs: every static server knows the JavaScript MIME type for .js.
copy dompurify dist/purify.es.mjs:purify.es.js LICENSE LICENSE-MPL

echo "vendored into $out:"
(cd "$out" && find . -type f | sort)

"""{{distribution}}: the {{name}} model plugin for diffpipe."""

"""diffpipe model plugin for Krea 2 (``krea2``) and Krea 2 Turbo (``krea2-turbo``)."""

"""One module per architecture, named as `general.architecture`, each defining `ARCH`
(models/arch.py says what an architecture declares)."""

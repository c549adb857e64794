"""One module per reasoning parser, named as the parser; each defines ``PARSER``."""

"""Jinja templates of the instruction kinds; a package only so importlib.resources finds them as fusec.templates."""

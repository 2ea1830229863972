"""Graph passes over the fusec IR; shipped as fusec.passes."""

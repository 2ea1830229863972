"""Package list for setuptools (everything else is in pyproject.toml).

The compiler core is the folder fusec/, but the graph passes (passes/) and the Jinja templates
(templates/) sit at the top of the repository and ship inside fusec as fusec.passes and
fusec.templates (the mapping is [tool.setuptools] package-dir in pyproject.toml). pyproject's
packages.find cannot put a prefix on what it finds, and an explicit list there would either
miss new subpackages or name folders that do not exist yet, so the list is computed here.
"""
from setuptools import find_packages, setup


def _packages() -> list[str]:
    core = find_packages(include=["fusec", "fusec.*"])
    passes = ["fusec.passes"] + ["fusec.passes." + p for p in find_packages("passes")]
    # templates/ is data only: one package, its files (subfolders too) picked by package-data.
    return core + passes + ["fusec.templates"]


setup(packages=_packages())

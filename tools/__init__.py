"""Maintainer scripts for the workbook (not imported by the notebooks).

- ``make_labs``  generate the exercise notebooks in ``labs/`` from the solved ones in ``solutions/``
"""

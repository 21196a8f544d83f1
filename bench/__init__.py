"""Batchery's benchmarks (`make bench`, `python manage.py bench`): not part of the product.

A Django app of a checkout only (the settings install it where this folder exists; images leave it
out). Workers import `bench.engines` for the zero-cost and sleeping models the benches register.
"""

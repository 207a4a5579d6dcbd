"""Helpers the tests share: tiny model and dataset builders, run folders, the Hub protocol double."""

"""Tests of the researcher's ``tp`` CLI and the project files it reads."""

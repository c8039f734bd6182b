"""TunePlane benchmarks: ``python -m bench [names]`` runs ``bench/<name>.py``'s ``main()``."""

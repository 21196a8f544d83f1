"""Operating the fleet: slots and draining, Flower, and the platform's Prometheus metrics."""

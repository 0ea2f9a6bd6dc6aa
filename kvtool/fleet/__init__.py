"""Fleets: several replicas behind a router. Routers (routers, prefix_record), a simulated fleet on one
simulated clock (simulated_fleet), its reports per replica and for the fleet (fleet_rows), and the search
for the cheapest fleet that meets an SLO (slo_search)."""

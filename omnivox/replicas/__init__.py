"""`omnivox serve --replicas N` on Ray Serve: an ingress (ingress.py) forwards each request to one
of N engine replicas (engine.py: omnivox's own app, in-process, driven through bridge.py), chosen
by the router (router.py over routing.py's pure policy; digest.py's request digests). app.py
builds the Serve application, launch.py runs it on the Ray that ray_cluster.py starts (token
authentication on, loopback) or joins, and says what listens where (listeners.py). Only this
package (and omnivox/ray_app.py) imports ray."""

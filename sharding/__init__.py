"""Device meshes, tensor layouts, sharding propagation, resharding and segmentation.

Not built yet: see the multi-device issue. Layers import only downward; this
package builds on ``fusion``.
"""

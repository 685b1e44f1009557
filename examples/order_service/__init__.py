"""The reference business service (seed 000): orders handed to Orbit through the outbox,
fulfilled as durable steps by a worker, their outcome brought back through the inbox.

Modules: :mod:`.db` (business tables), :mod:`.api` (the order API), :mod:`.providers`
(fake inventory, payment and receipt services that record every call), :mod:`.worker`
(the ``orders.fulfil`` handler and its journal), :mod:`.consumer` (results back into
``business_orders``) and :mod:`.demo` (all of it as real processes, with crashes).
"""

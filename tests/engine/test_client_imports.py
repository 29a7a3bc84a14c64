"""The EngineCore clients import in one direction: the subclass modules import the base module,
the factory imports them all, and nothing imports back (no circle, lazy imports included)."""

import grimp

BASE = "tokenbus.engine.core_client"
MP = "tokenbus.engine.mp_client"
DP = "tokenbus.engine.dp_client"
FACTORY = "tokenbus.engine.client_factory"


def test_client_modules_import_without_a_circle():
    # grimp reads every import statement: module level, inside functions, under TYPE_CHECKING.
    graph = grimp.build_graph("tokenbus")
    for importer, imported in [(BASE, MP), (BASE, DP), (MP, DP), (BASE, FACTORY), (MP, FACTORY)]:
        chain = graph.find_shortest_chain(importer=importer, imported=imported)
        assert chain is None, f"{importer} reaches {imported}: {' -> '.join(chain)}"
    for module in (BASE, MP, DP, FACTORY):
        for imported in graph.find_modules_directly_imported_by(module):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            assert back is None, f"{module} -> {' -> '.join(back)}: an import circle"
    assert graph.direct_import_exists(importer=MP, imported=BASE)
    assert graph.direct_import_exists(importer=FACTORY, imported=DP)

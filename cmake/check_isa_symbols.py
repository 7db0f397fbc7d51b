"""Fails if an object of one instruction-set build could lend its code to another build.

Code with vague linkage (weak functions: inline functions, template instantiations) is merged
by the linker into one copy for the whole module, possibly the copy of an AVX-512 build, which
would then run on every CPU. The kernels keep their own code inside their namespace
sgrnn::cpu::<ISA>; a weak function outside it (a standard library's inline helper) is allowed
only when its bytes equal the baseline build's copy, so that whichever copy the linker keeps
is baseline code. Weak data holds no instructions and is not checked.

Usage: python check_isa_symbols.py ISA BASELINE_OBJECT OBJECT...  (ELF64 little-endian)
"""

import struct
import sys

STB_WEAK = 2
STT_FUNC = 2
SHT_SYMTAB = 2


def weak_functions(path: str) -> dict[str, bytes]:
    """Mangled name -> machine code (relocated fields as zeros) of each weak function."""
    with open(path, "rb") as f:
        elf = f.read()
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        sys.exit(f"{path}: not an ELF64 little-endian object")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
                for i in range(shnum)]

    def data(index: int) -> bytes:
        _, _, _, _, offset, size, *_ = sections[index]
        return elf[offset:offset + size]

    found = {}
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != SHT_SYMTAB:
            continue
        names = data(link)
        for pos in range(offset, offset + size, entsize):
            name_at, info, _, shndx, value, length = struct.unpack_from("<IBBHQQ", elf, pos)
            if info >> 4 == STB_WEAK and info & 0xF == STT_FUNC:
                name = names[name_at:names.index(b"\0", name_at)].decode()
                found[name] = data(shndx)[value:value + length]
    return found


def main(isa: str, baseline: str, objects: list[str]) -> None:
    own_namespace = f"5sgrnn3cpu{len(isa)}{isa}"  # sgrnn::cpu::<ISA> as Itanium mangling spells it
    baseline_code = weak_functions(baseline)
    for path in objects:
        for name, code in weak_functions(path).items():
            if own_namespace in name:
                continue
            if baseline_code.get(name) != code:
                sys.exit(f"{path}: '{name}' has vague linkage outside sgrnn::cpu::{isa} and "
                         f"differs from the baseline build's copy (or it has none); the linker "
                         f"may keep this {isa} copy for every CPU")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

# Fails if an object of one instruction-set build defines a symbol with vague linkage (weak:
# inline functions, template instantiations) outside its own namespace sgrnn::cpu::<ISA>: the
# linker keeps one copy of such a symbol for the whole module, which could be this build's.
# Usage: cmake -DNM=nm -DOBJECTS="a.o;b.o" -DISA=x86_64_v4 -P check_isa_symbols.cmake
foreach(object IN LISTS OBJECTS)
  execute_process(COMMAND "${NM}" -C --defined-only "${object}"
                  OUTPUT_VARIABLE symbols COMMAND_ERROR_IS_FATAL ANY)
  string(REPLACE "\n" ";" symbols "${symbols}")
  foreach(line IN LISTS symbols)
    # nm's W/V: weak symbols. DW.ref.* are the exception tables' personality pointers (data,
    # identical in every build).
    if(line MATCHES "^[0-9a-fA-F]* [WV] (.*)$")
      set(name "${CMAKE_MATCH_1}")
      if(NOT name MATCHES "sgrnn::cpu::${ISA}::" AND NOT name MATCHES "^DW\\.ref\\.")
        message(FATAL_ERROR "${object}: '${name}' has vague linkage outside sgrnn::cpu::${ISA} "
                            "in the ${ISA} build; the linker may share it with other builds")
      endif()
    endif()
  endforeach()
endforeach()

# Fails if an object of one instruction-set build defines code with vague linkage (weak: inline
# functions, template instantiations) outside its own namespace sgrnn::cpu::<ISA>: the linker
# keeps one copy of such a function for the whole module, which could be this build's. Weak
# data (nm's V: typeinfo, vtables, the exception tables' DW.ref pointers) holds no instructions
# and is the same in every build.
# Usage: cmake -DNM=nm -DOBJECTS="a.o;b.o" -DISA=x86_64_v4 -P check_isa_symbols.cmake
foreach(object IN LISTS OBJECTS)
  execute_process(COMMAND "${NM}" -C --defined-only "${object}"
                  OUTPUT_VARIABLE symbols COMMAND_ERROR_IS_FATAL ANY)
  string(REPLACE "\n" ";" symbols "${symbols}")
  foreach(line IN LISTS symbols)
    if(line MATCHES "^[0-9a-fA-F]* W (.*)$")  # nm's W: a weak function
      set(name "${CMAKE_MATCH_1}")
      if(NOT name MATCHES "sgrnn::cpu::${ISA}::")
        message(FATAL_ERROR "${object}: '${name}' has vague linkage outside sgrnn::cpu::${ISA} "
                            "in the ${ISA} build; the linker may share it with other builds")
      endif()
    endif()
  endforeach()
endforeach()

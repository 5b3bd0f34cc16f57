/* switch_x86_64.S: the fiber context switch of the CUDA-on-CPU runtime.
 *
 *   void cocpu_switch(void **save_sp, void *new_sp);
 *
 * Saves what the System V x86-64 ABI makes callee-saved (rbx, rbp, r12-r15, the MXCSR
 * control bits and the x87 control word) on the current stack, stores the stack
 * pointer to *save_sp, then loads new_sp and restores the same set from there. Caller-
 * saved registers are dead across the call by the ABI, so this is a complete switch.
 *
 * Frame written (and expected) at a saved stack pointer, lowest address first:
 *   [sp+0] mxcsr (4 bytes)  [sp+4] x87 cw (2 bytes)
 *   [sp+8] r15  [sp+16] r14  [sp+24] r13  [sp+32] r12  [sp+40] rbx  [sp+48] rbp
 *   [sp+56] return address
 * The runtime builds this frame by hand to start a fiber (prepare_fiber, scheduler.cpp).
 */
    .text
    .globl  cocpu_switch
    .hidden cocpu_switch
    .type   cocpu_switch, @function
    .p2align 4
cocpu_switch:
    pushq   %rbp
    pushq   %rbx
    pushq   %r12
    pushq   %r13
    pushq   %r14
    pushq   %r15
    subq    $8, %rsp
    stmxcsr (%rsp)
    fnstcw  4(%rsp)
    movq    %rsp, (%rdi)
    movq    %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw   4(%rsp)
    addq    $8, %rsp
    popq    %r15
    popq    %r14
    popq    %r13
    popq    %r12
    popq    %rbx
    popq    %rbp
    ret
    .size   cocpu_switch, .-cocpu_switch

    .section .note.GNU-stack, "", @progbits

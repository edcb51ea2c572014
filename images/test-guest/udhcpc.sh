#!/bin/sh
# udhcpc event script: applies the lease (address, MTU, option 121 routes or router, DNS) and
# reports every option the launcher's DHCP server sent.
# shellcheck disable=SC2154 # udhcpc passes the lease ($interface, $ip, $mask, $dns, ...) in the environment
say() { echo "CAPK-TESTGUEST $*" >/dev/console; }
case "$1" in
  bound|renew)
    ip addr flush dev "$interface"
    ip addr add "$ip/$mask" dev "$interface"
    [ -n "$mtu" ] && ip link set "$interface" mtu "$mtu"
    if [ -n "$staticroutes" ]; then
      # shellcheck disable=SC2086 # "dest/len gw dest/len gw ...": one word each
      set -- $staticroutes
      while [ $# -ge 2 ]; do
        if [ "$2" = "0.0.0.0" ]; then ip route add "$1" dev "$interface"
        else ip route add "$1" via "$2" dev "$interface"; fi
        shift 2
      done
    elif [ -n "$router" ]; then
      ip route add default via "${router%% *}" dev "$interface"
    fi
    : >/etc/resolv.conf
    [ -n "$search" ] && echo "search $search" >>/etc/resolv.conf
    for d in $dns; do echo "nameserver $d" >>/etc/resolv.conf; done
    say "lease ip=$ip/$mask router=$router staticroutes=$staticroutes hostname=$hostname domain=$domain search=$search dns=$dns ntp=$ntpsrv mtu=$mtu lease=$lease serverid=$serverid"
    [ -n "$hostname" ] && hostname "$hostname"
    ;;
esac
exit 0

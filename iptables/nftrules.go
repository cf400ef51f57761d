package iptables

import (
	"encoding/binary"
	"fmt"

	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// nftReadRules reads the rules of one chain of detour's table from the kernel, decoding their
// expressions itself: google/nftables (v0.3.0) drops the expressions it cannot decode when it
// reads rules back — the socket lookup of the inbound rule among them — which would make CHECK
// blind to them. An expression of a kind detour never writes is kept as a placeholder
// (expr.Match named "unknown <kind>"), so a rule someone changed never reads as detour's. Like
// nftConn, it opens its socket on the calling thread, in its network namespace.
func nftReadRules(chain string) ([]NFTRule, error) {
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return nil, fmt.Errorf("open nf_tables netlink: %w", err)
	}
	defer conn.Close()
	attrs, err := netlink.MarshalAttributes([]netlink.Attribute{
		{Type: unix.NFTA_RULE_TABLE, Data: []byte(NFTTable + "\x00")},
		{Type: unix.NFTA_RULE_CHAIN, Data: []byte(chain + "\x00")},
	})
	if err != nil {
		return nil, err
	}
	req := netlink.Message{
		Header: netlink.Header{
			Type:  netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETRULE),
			Flags: netlink.Request | netlink.Dump,
		},
		// nfgenmsg: the inet family, version 0, resource id 0.
		Data: append([]byte{unix.NFPROTO_INET, unix.NFNETLINK_V0, 0, 0}, attrs...),
	}
	replies, err := conn.Execute(req)
	if err != nil {
		return nil, fmt.Errorf("list the rules of chain %s: %w", chain, err)
	}
	var rules []NFTRule
	for _, m := range replies {
		if len(m.Data) < 4 {
			continue
		}
		r, err := decodeNFTRule(m.Data[4:])
		if err != nil {
			return nil, fmt.Errorf("decode a rule of chain %s: %w", chain, err)
		}
		rules = append(rules, r)
	}
	return rules, nil
}

// decodeNFTRule decodes a rule's attributes: its expressions and its comment.
func decodeNFTRule(b []byte) (NFTRule, error) {
	var r NFTRule
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return r, err
	}
	ad.ByteOrder = binary.BigEndian
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_RULE_EXPRESSIONS:
			ad.Nested(func(list *netlink.AttributeDecoder) error {
				for list.Next() {
					list.Nested(func(elem *netlink.AttributeDecoder) error {
						e, err := decodeNFTExpr(elem)
						if err == nil {
							r.Exprs = append(r.Exprs, e)
						}
						return err
					})
				}
				return nil
			})
		case unix.NFTA_RULE_USERDATA:
			r.Comment, _ = userdata.GetString(ad.Bytes(), userdata.TypeComment)
		}
	}
	return r, ad.Err()
}

// decodeNFTExpr decodes one expression (its name and data attributes).
func decodeNFTExpr(ad *netlink.AttributeDecoder) (expr.Any, error) {
	ad.ByteOrder = binary.BigEndian
	var name string
	var data []byte
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_EXPR_NAME:
			name = ad.String()
		case unix.NFTA_EXPR_DATA:
			data = ad.Bytes()
		}
	}
	if err := ad.Err(); err != nil {
		return nil, err
	}
	var e expr.Any
	switch name {
	case "meta":
		e = &expr.Meta{}
	case "cmp":
		e = &expr.Cmp{}
	case "payload":
		e = &expr.Payload{}
	case "bitwise":
		e = &expr.Bitwise{}
	case "range":
		e = &expr.Range{}
	case "immediate":
		e = &expr.Immediate{}
	case "redir":
		e = &expr.Redir{}
	case "socket":
		e = &expr.Socket{}
	default:
		return &expr.Match{Name: "unknown " + name}, nil
	}
	if err := expr.Unmarshal(byte(unix.NFPROTO_INET), data, e); err != nil {
		return nil, fmt.Errorf("decode a %s expression: %w", name, err)
	}
	// A verdict is an immediate into the verdict register.
	if imm, ok := e.(*expr.Immediate); ok && imm.Register == unix.NFT_REG_VERDICT && len(imm.Data) == 0 {
		v := &expr.Verdict{}
		if err := expr.Unmarshal(byte(unix.NFPROTO_INET), data, v); err != nil {
			return nil, fmt.Errorf("decode a verdict: %w", err)
		}
		e = v
	}
	return e, nil
}
